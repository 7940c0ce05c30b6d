"""Expand ``A`` of a stride-1 convolution from products of the input with itself shifted.

A convolution's expand factor is ``A = (1/n) Σ_p ā_p ā_pᵀ`` over its ``n = b·Ho·Wo``
output positions, ``ā_p`` the input patch at ``p``. Ordered by kernel offset, its block
``(i, j)`` is ``Σ_p x[p + δ_i] x[p + δ_j]ᵀ`` (``δ_i`` the input offset of kernel offset
``i``, ``x`` zero outside the image). With stride 1 the sum runs over ``q = p + δ_i``:

    A_ij = Σ_{q ∈ P + δ_i} x[q] x[q + Δ]ᵀ,   Δ = δ_j − δ_i,

so every block is, up to a border, the product of the input with itself shifted by
``Δ``: ``S(Δ) = Σ_{q in the image} x[q] x[q + Δ]ᵀ``. There are ``(2kh−1)(2kw−1)``
distinct shifts, and ``S(−Δ) = S(Δ)ᵀ``, so a 3x3 kernel needs 13 products of ``C x C``
where the patch rows need one of ``9C x 9C`` (81 blocks): about a sixth of the flops,
and no patch rows (the input is copied once, channels-last). The border is what the
window ``P + δ_i`` leaves out of the image: ``E_i``, a strip of ``|δ_i|`` rows and
columns along the edges. Then ``A_ij = S(Δ) − Σ_{q ∈ E_i} x[q] x[q + Δ]ᵀ``; the strips'
products for all ``j`` are one batched GEMM of the strip pixels against their patches.

**One buffer, shifts as offsets.** The input is laid out channels-last and flattened,
``(rows, C)``, each image followed by ``dh·(kh−1)`` zero rows and each image row by
``dw·(kw−1)`` zero columns. A shift ``Δ = (Δh, Δw)`` is then the offset ``Δh·Wp + Δw``
rows of the buffer (``Wp`` the padded width): a shift that leaves the image lands on
zeros, never on another row or image. So ``S(Δ)`` is one GEMM of two views of the same
buffer: ``bufᵀ[0:N] · buf[s:s+N]``, no copies.

**Cost.** For a 3x3 kernel with ``Ho = H``: ``13·b·(H+2)(W+2)·C²`` multiply-adds for the
shifted products and about ``b·(H+W)·8·9·C²`` for the borders, against ``b·H·W·81·C²``
(one GEMM of the patch rows) or about half of that (a symmetric rank-k update): 2-5x
fewer at ``H = 14..56``, about as many at ``H = 7``
(:func:`shifted_products_flops`). Where it is used is :func:`pays`, measured with
``benchmarks/conv_shifts.py`` (docs/design.md, "Convolution statistics by shifted
products").

The result equals the patch path up to summation order (tested at 1e-12 in float64 for
padding incl. ``"same"`` and none, dilation, bias, non-square kernels) and is exactly
symmetric.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import Tensor

from kfac_hpc.kfac.precision import MatmulPrecision, matmul, round_operand

__all__ = ["SHIFTED_PRODUCTS_DEVICES", "pays", "shifted_covariance", "shifted_products_flops"]

Pads = tuple[int, int, int, int]  # (top, bottom, left, right)
Pair = tuple[int, int]

#: Devices whose stride-1 convolutions take the shifted products where :func:`pays` says
#: so. The CPU: 1.15-2.3x faster there than the patch paths on ResNet-20's
#: and ResNet-50's layers (2-core Xeon, benchmarks/RESULTS.md). Not yet CUDA: there the
#: patch rows' one GEMM runs on tensor cores, and the shifts are 13 GEMMs and a gather
#: per layer; ``benchmarks/conv_shifts.py --device cuda`` decides.
SHIFTED_PRODUCTS_DEVICES: frozenset[str] = frozenset({"cpu"})

#: Where the shifted products need at most this share of the multiply-adds of the patch
#: rows' symmetric update (at 8x8 maps and smaller, 0.9 and more, they gained at most 12 %
#: and lost within a training step).
FLOPS_BELOW = 0.7
#: From this many input channels the shifted products pay at any batch size. With fewer,
#: each ``C x C`` product streams the input from memory once per shift, so they pay
#: only while the input (:data:`CACHED_INPUT` elements) stays in cache.
MANY_CHANNELS = 64
CACHED_INPUT = 1 << 20

_HOST = torch.device("cpu")  # the layouts' indices are built here (whatever the default device)


@dataclass(frozen=True)
class _Layout:
    """Where everything lies in the flattened buffer, for one input geometry."""

    images_at: int  # first row of the first image
    image_rows: int  # buffer rows per image (Hp·Wp)
    padded: Pair  # (Hp, Wp)
    length: int  # buffer rows in all
    shifts: tuple[int, ...]  # buffer offsets of the shifts Δ ≥ 0 (row-major order)
    block_source: Tensor  # (kk, kk): block (i, j) is table[k] (table = S, then Sᵀ)
    border_offsets: Tensor  # (m,): the kernel offsets whose window misses pixels
    border_rows: Tensor  # (m·n_max,): the missed pixels' rows, each offset's padded to n_max
    border_patches: Tensor  # (m·n_max·kk,): the rows of those pixels' patches
    upper_blocks: Tensor  # (2, kk·(kk−1)/2): (i, j) of the blocks above the diagonal
    lower_blocks: Tensor  # (2, kk·(kk−1)/2): (j, i) of the same blocks


def _output_size(h: int, w: int, kernel_size: Pair, dilation: Pair, pads: Pads) -> Pair:
    (kh, kw), (dh, dw) = kernel_size, dilation
    top, bottom, left, right = pads
    return h + top + bottom - dh * (kh - 1), w + left + right - dw * (kw - 1)


def _missed(h: int, w: int, wp: int, kernel_size: Pair, dilation: Pair, pads: Pads
            ) -> list[tuple[int, Tensor]]:
    """Per kernel offset whose window misses pixels: (offset, their rows in an image)."""
    (kh, kw), (dh, dw) = kernel_size, dilation
    top, _, left, _ = pads
    ho, wo = _output_size(h, w, kernel_size, dilation, pads)
    rows = torch.arange(h, device=_HOST).unsqueeze(1)
    cols = torch.arange(w, device=_HOST).unsqueeze(0)
    missed = []
    for k, (ih, iw) in enumerate((i, j) for i in range(kh) for j in range(kw)):
        r0, c0 = ih * dh - top, iw * dw - left
        inside = (rows >= r0) & (rows < r0 + ho) & (cols >= c0) & (cols < c0 + wo)
        pixels = (rows * wp + cols)[~inside]
        if pixels.numel():
            missed.append((k, pixels))
    return missed


@functools.lru_cache(maxsize=128)
def _layout(b: int, h: int, w: int, kernel_size: Pair, dilation: Pair, pads: Pads,
            device: torch.device) -> _Layout:
    (kh, kw), (dh, dw) = kernel_size, dilation
    top, _, left, _ = pads
    hp, wp = h + dh * (kh - 1), w + dw * (kw - 1)
    reach = dh * (kh - 1) * wp + dw * (kw - 1)  # the largest |offset| of a shift
    images_at = reach + 1  # zeros before the first image; row ``reach`` pads the borders
    image_rows = hp * wp
    steps = [(a, e) for a in range(kh) for e in range(-(kw - 1), kw) if a > 0 or e >= 0]
    where = {step: k for k, step in enumerate(steps)}
    offsets = [(i, j) for i in range(kh) for j in range(kw)]
    source = [[where[(jh - ih, jw - iw)] if (jh - ih, jw - iw) in where
               else len(steps) + where[(ih - jh, iw - jw)]
               for jh, jw in offsets] for ih, iw in offsets]
    flat = torch.tensor([(ih * dh - top) * wp + (iw * dw - left) for ih, iw in offsets],
                        device=_HOST)
    missed = _missed(h, w, wp, kernel_size, dilation, pads)
    starts = images_at + image_rows * torch.arange(b, device=_HOST).unsqueeze(1)
    widest = b * max((p.numel() for _, p in missed), default=0)
    border_rows = torch.full((len(missed), widest), reach, dtype=torch.long, device=_HOST)
    for r, (_, pixels) in enumerate(missed):
        border_rows[r, :b * pixels.numel()] = (starts + pixels).reshape(-1)
    border_offsets = torch.tensor([k for k, _ in missed], dtype=torch.long, device=_HOST)
    relative = flat.unsqueeze(0) - flat[border_offsets].unsqueeze(1)  # (m, kk): δ_j − δ_i
    patches = border_rows.unsqueeze(2) + relative.unsqueeze(1)
    upper = torch.triu_indices(kh * kw, kh * kw, 1, device=_HOST)
    return _Layout(
        images_at, image_rows, (hp, wp), images_at + b * image_rows + reach,
        tuple(a * dh * wp + e * dw for a, e in steps),
        torch.tensor(source, dtype=torch.long, device=_HOST).to(device), border_offsets.to(device),
        border_rows.reshape(-1).to(device), patches.reshape(-1).to(device),
        upper.to(device), upper.flip(0).to(device))


def shifted_covariance(x: Tensor, kernel_size: Pair, dilation: Pair, pads: Pads, *,
                       append_one: bool = False,
                       precision: MatmulPrecision = "full") -> Tensor:
    """Expand ``A`` of a stride-1 convolution from shifted products of its input.

    Args:
        x: The layer input, ``(b, C, H, W)``.
        kernel_size: ``(kh, kw)``.
        dilation: ``(dh, dw)``.
        pads: Zero padding ``(top, bottom, left, right)``.
        append_one: Append the bias row and column (``Σ ā`` and the row count).
        precision: Operand precision of the products (:mod:`kfac_hpc.kfac.precision`).

    Returns:
        ``(d, d)``, ``d = C·kh·kw (+1)``, columns in the weight's ``(c, i, j)`` order and
        the bias last, divided by the ``b·Ho·Wo`` output positions; exactly symmetric,
        in ``x``'s dtype.

    Raises:
        ValueError: For an input that is not 4-D or a convolution with no output.
    """
    if x.dim() != 4:
        raise ValueError(f"shifted_covariance expects (b, C, H, W) input, got {tuple(x.shape)}")
    b, c, h, w = x.shape
    ho, wo = _output_size(h, w, kernel_size, dilation, pads)
    if b == 0 or ho <= 0 or wo <= 0:
        raise ValueError("covariance of zero rows is undefined")
    kk = kernel_size[0] * kernel_size[1]
    lay = _layout(b, h, w, kernel_size, dilation, pads, x.device)
    with torch.autocast(device_type=x.device.type, enabled=False):
        buf = x.new_zeros(lay.length, c)
        n_all = b * lay.image_rows
        images = buf[lay.images_at:lay.images_at + n_all]
        images.view(b, *lay.padded, c)[:, :h, :w] = x.permute(0, 2, 3, 1)
        products = torch.stack([
            matmul(images.t(), buf[lay.images_at + s:lay.images_at + s + n_all], precision)
            for s in lay.shifts])
        blocks = torch.cat([products, products.transpose(1, 2)])[lay.block_source]
        m = lay.border_offsets.numel()
        # the bias column sums the operands as the products see them (rounded or not)
        sums = round_operand(images, precision).sum(dim=0).expand(kk, c) if append_one else None
        if m:  # the pixels each offset's window misses, against their patches
            missed = buf.index_select(0, lay.border_rows).reshape(m, -1, c)
            patches = buf.index_select(0, lay.border_patches).reshape(m, -1, kk * c)
            border = matmul(missed.transpose(1, 2), patches, precision)
            blocks[lay.border_offsets] -= border.reshape(m, c, kk, c).permute(0, 2, 1, 3)
            if sums is not None:
                sums = sums.clone()
                sums[lay.border_offsets] -= round_operand(missed, precision).sum(dim=1)
        full = _symmetric(blocks, lay).permute(2, 0, 3, 1).reshape(c * kk, c * kk)
        if sums is not None:  # weight order (c, i); the bias row and column
            d = c * kk
            column = sums.t().reshape(-1)
            with_bias = full.new_empty(d + 1, d + 1)
            with_bias[:d, :d] = full
            with_bias[:d, d] = column
            with_bias[d, :d] = column
            with_bias[d, d] = b * ho * wo
            full = with_bias
    return full.div_(b * ho * wo)


def _symmetric(blocks: Tensor, lay: _Layout) -> Tensor:
    """The blocks with each lower block the transposed upper one, the diagonal ones mirrored.

    The shifted products alone are symmetric (``S(−Δ) = S(Δ)ᵀ``); the borders' products
    are to rounding. Exactly symmetric, at the cost of copying the blocks above the
    diagonal (a transposed read per ``C x C`` block, not across the whole matrix).
    """
    up, low = lay.upper_blocks, lay.lower_blocks
    blocks[low[0], low[1]] = blocks[up[0], up[1]].transpose(1, 2)
    diagonal = torch.arange(blocks.shape[0], device=blocks.device)
    on = blocks[diagonal, diagonal]
    blocks[diagonal, diagonal] = on.triu() + on.triu(1).transpose(1, 2)
    return blocks


@functools.lru_cache(maxsize=256)
def shifted_products_flops(b: int, h: int, w: int, kernel_size: Pair, dilation: Pair,
                           pads: Pads) -> tuple[int, int]:
    """Multiply-adds per ``C²`` of the shifted products and of the patch rows' product.

    Returns:
        ``(shifted, rows)``: the shifted products with their borders (as computed:
        each offset's border padded to the widest), and one full GEMM of the
        ``b·Ho·Wo`` patch rows (``(kh·kw)²`` blocks; a symmetric update does about half).
    """
    (kh, kw), (dh, dw) = kernel_size, dilation
    ho, wo = _output_size(h, w, kernel_size, dilation, pads)
    kk = kh * kw
    hp, wp = h + dh * (kh - 1), w + dw * (kw - 1)
    missed = _missed(h, w, wp, kernel_size, dilation, pads)
    border = len(missed) * max((p.numel() for _, p in missed), default=0) * kk
    n_shifts = ((2 * kh - 1) * (2 * kw - 1) + 1) // 2
    return b * (n_shifts * hp * wp + border), b * ho * wo * kk * kk


def pays(x: Tensor, kernel_size: Pair, stride: Pair, dilation: Pair, pads: Pads) -> bool:
    """Say whether a convolution's expand ``A`` comes from shifted products.

    On :data:`SHIFTED_PRODUCTS_DEVICES`, for stride 1 and a kernel of more than one
    offset, where they need at most :data:`FLOPS_BELOW` of the multiply-adds of the
    symmetric update, with :data:`MANY_CHANNELS` input channels or an input of fewer
    than :data:`CACHED_INPUT` elements.
    """
    if x.device.type not in SHIFTED_PRODUCTS_DEVICES or x.dim() != 4:
        return False
    if tuple(stride) != (1, 1) or kernel_size[0] * kernel_size[1] == 1:
        return False
    b, c, h, w = x.shape
    if c < MANY_CHANNELS and x.numel() >= CACHED_INPUT:
        return False
    shifted, rows = shifted_products_flops(b, h, w, tuple(kernel_size), tuple(dilation),
                                           tuple(pads))
    return shifted <= FLOPS_BELOW * rows / 2
