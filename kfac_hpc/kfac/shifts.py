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
and the input is copied once, channels-last, instead of into patch rows. The border is
what the window ``P + δ_i`` leaves out of the image: ``E_i``, a strip of ``|δ_i|`` rows
and columns along the edges. Then ``A_ij = S(Δ) − Σ_{q ∈ E_i} x[q] x[q + Δ]ᵀ``; the
strips' products are GEMMs of the strip pixels against their patch blocks from offset
``i`` on (those below the diagonal are transposes): the only patches built, gathered for
a few images at a time (at most :data:`BORDER_CHUNK` elements), so the extra memory does
not grow with the batch.

**One buffer, shifts as offsets.** The input is laid out channels-last and flattened,
``(rows, C)``, each image followed by ``dh·(kh−1)`` zero rows and each image row by
``dw·(kw−1)`` zero columns. A shift ``Δ = (Δh, Δw)`` is then the offset ``Δh·Wp + Δw``
rows of the buffer (``Wp`` the padded width): a shift that leaves the image lands on
zeros, never on another row or image. So ``S(Δ)`` is one GEMM of two views of the same
buffer: ``bufᵀ[0:N] · buf[s:s+N]``, no copies.

**Cost.** For a 3x3 "same" kernel on an ``H×H`` map: ``13·b·(H+2)²·C²`` multiply-adds
for the shifted products and about ``60·b·H·C²`` for the borders (each offset's missed
pixels against the blocks from it on), against ``b·H²·81·C²`` (one GEMM of the patch
rows): 3.8-5.4x fewer at ``H = 14..56``, 2.7x at ``H = 7``; against the symmetric rank-k
update of the CPU's patch path (about half the GEMM's) 0.37-0.52 of its multiply-adds at
``H = 14..56`` and 0.73 at ``H = 7`` (:func:`shifted_products_flops`). Where it is used is
:func:`pays`, measured with ``benchmarks/conv_shifts.py`` (docs/design.md, "Convolution
statistics by shifted products").

The result equals the patch path up to summation order (tested at 1e-12 in float64 for
padding incl. ``"same"`` and none, dilation, bias, non-square kernels) and is exactly
symmetric. In float32 the subtraction of the borders cancels where they are a large part
of the image (tiny maps, "valid" padding: up to 6.7e-6 relative where the multiply-adds
are 9-33x the symmetric update's, which :func:`pays` never takes); on the maps it takes
the error is the patch path's (tested at 7x7 and 8x8).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import cast

import torch
from torch import Tensor

from kfac_hpc.kfac.patches import conv_output_size
from kfac_hpc.kfac.precision import MatmulPrecision, matmul, round_operand

__all__ = ["SHIFTED_PRODUCTS_PATHS", "pays", "shifted_covariance", "shifted_products_flops"]

Pads = tuple[int, int, int, int]  # (top, bottom, left, right)
Pair = tuple[int, int]

#: The statistics paths (``"cpu"``, ``"gpu"``: :func:`~kfac_hpc.kfac.linalg.uses_gpu_path`)
#: whose stride-1 convolutions take the shifted products where :func:`pays` says so. The
#: CPU: ResNet-50's stride-1 3x3 layers 1.7-3x faster than the patch paths (2-core Xeon,
#: benchmarks/RESULTS.md). Not the GPU: on an H200 (``benchmarks/conv_shifts.py --device
#: cuda``, TF32, batch 32) the shifts took about 2.4 ms per layer whatever its size, the
#: patch rows' one GEMM 0.2-0.7 ms (13 GEMMs and a gather and a GEMM per border offset
#: are launch-bound there).
SHIFTED_PRODUCTS_PATHS: frozenset[str] = frozenset({"cpu"})

#: Where the shifted products need at most this share of the multiply-adds of the patch
#: rows' symmetric update: 3x3 "same" layers on maps of 7x7 and more (0.73 there; 0.37 at
#: 56x56), where they took 0.33-0.98x the time of the faster patch path on this CPU.
#: Smaller maps (1.06 at 4x4) were not measured.
FLOPS_BELOW = 0.75

#: Elements of the border patches gathered at once (a few images at a time).
BORDER_CHUNK = 1 << 22

_HOST = torch.device("cpu")  # the layouts' indices are built here (whatever the default device)


@dataclass(frozen=True)
class _Layout:
    """Where everything lies in the flattened buffer, for one image geometry.

    The buffer holds ``images_at`` zero rows, the images (``image_rows`` each), and
    ``reach`` zero rows.
    """

    reach: int  # the largest |offset| of a shift, in buffer rows
    image_rows: int  # buffer rows per image (Hp·Wp)
    padded: Pair  # (Hp, Wp)
    shifts: tuple[int, ...]  # buffer offsets of the shifts Δ ≥ 0 (row-major order)
    block_source: Tensor  # (kk, kk): block (i, j) is table[k] (table = S, then Sᵀ)
    border_offsets: tuple[int, ...]  # the kernel offsets whose window misses pixels
    border_patches: tuple[Tensor, ...]  # per such offset k, (P_k, kk − k): the rows (from
    #   an image's start) of its missed pixels' patches from offset k on (the blocks on
    #   and above the diagonal; column 0 is the pixel itself)
    upper_blocks: Tensor  # (2, kk·(kk−1)/2): (i, j) of the blocks above the diagonal
    lower_blocks: Tensor  # (2, kk·(kk−1)/2): (j, i) of the same blocks

    @property
    def images_at(self) -> int:
        """The first row of the first image (after ``reach + 1`` zero rows)."""
        return self.reach + 1

    def length(self, b: int) -> int:
        """Buffer rows for ``b`` images."""
        return self.images_at + b * self.image_rows + self.reach


def _missed(h: int, w: int, wp: int, kernel_size: Pair, dilation: Pair, pads: Pads
            ) -> list[tuple[int, Tensor]]:
    """Per kernel offset whose window misses pixels: (offset, their rows in an image)."""
    (kh, kw), (dh, dw) = kernel_size, dilation
    top, _, left, _ = pads
    ho, wo = conv_output_size(h, w, kernel_size, (1, 1), dilation, pads)
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
def _layout(h: int, w: int, kernel_size: Pair, dilation: Pair, pads: Pads,
            device: torch.device) -> _Layout:
    (kh, kw), (dh, dw) = kernel_size, dilation
    top, _, left, _ = pads
    hp, wp = h + dh * (kh - 1), w + dw * (kw - 1)
    steps = [(a, e) for a in range(kh) for e in range(-(kw - 1), kw) if a > 0 or e >= 0]
    where = {step: k for k, step in enumerate(steps)}
    offsets = [(i, j) for i in range(kh) for j in range(kw)]
    source = [[where[(jh - ih, jw - iw)] if (jh - ih, jw - iw) in where
               else len(steps) + where[(ih - jh, iw - jw)]
               for jh, jw in offsets] for ih, iw in offsets]
    # buffer rows of kernel offset k relative to the output position: (ih·dh − top)·Wp + …
    flat = [(ih * dh - top) * wp + (iw * dw - left) for ih, iw in offsets]
    missed = _missed(h, w, wp, kernel_size, dilation, pads)
    later = torch.tensor(flat, device=_HOST)
    patches = tuple(  # the patch reading pixel q at offset k, from offset k on
        (pixels.unsqueeze(1) - flat[k] + later[k:]).to(device) for k, pixels in missed)
    upper = torch.triu_indices(kh * kw, kh * kw, 1, device=_HOST)
    return _Layout(
        dh * (kh - 1) * wp + dw * (kw - 1), hp * wp, (hp, wp),
        tuple(a * dh * wp + e * dw for a, e in steps),
        torch.tensor(source, dtype=torch.long, device=_HOST).to(device),
        tuple(k for k, _ in missed), patches, upper.to(device), upper.flip(0).to(device))


def shifted_covariance(x: Tensor, kernel_size: Pair, dilation: Pair, pads: Pads, *,
                       append_one: bool = False,
                       precision: MatmulPrecision = "full",
                       border_chunk: int = BORDER_CHUNK) -> Tensor:
    """Expand ``A`` of a stride-1 convolution from shifted products of its input.

    Args:
        x: The layer input, ``(b, C, H, W)``.
        kernel_size: ``(kh, kw)``.
        dilation: ``(dh, dw)``.
        pads: Zero padding ``(top, bottom, left, right)``.
        append_one: Append the bias row and column (``Σ ā`` and the row count).
        precision: Operand precision of the products (:mod:`kfac_hpc.kfac.precision`).
        border_chunk: Elements of border patches gathered at once (whole images, at
            least one).

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
    kernel = (int(kernel_size[0]), int(kernel_size[1]))
    dil = (int(dilation[0]), int(dilation[1]))
    pad4 = (int(pads[0]), int(pads[1]), int(pads[2]), int(pads[3]))
    ho, wo = conv_output_size(h, w, kernel, (1, 1), dil, pad4)
    if b == 0 or ho <= 0 or wo <= 0:
        raise ValueError("covariance of zero rows is undefined")
    kk = kernel[0] * kernel[1]
    lay = _layout(h, w, kernel, dil, pad4, x.device)
    with torch.autocast(device_type=x.device.type, enabled=False):
        buf = x.new_zeros(lay.length(b), c)
        n_all = b * lay.image_rows
        images = buf[lay.images_at:lay.images_at + n_all]
        images.view(b, *lay.padded, c)[:, :h, :w] = x.permute(0, 2, 3, 1)
        if precision != "full" and x.device.type == "cpu":  # round every operand once
            images.copy_(round_operand(images, precision))
            precision = "full"
        products = torch.stack([
            matmul(images.t(), buf[lay.images_at + s:lay.images_at + s + n_all], precision)
            for s in lay.shifts])
        blocks = torch.cat([products, products.transpose(1, 2)])[lay.block_source]
        # the bias column sums the operands as the products see them (rounded or not)
        sums = round_operand(images, precision).sum(dim=0).expand(kk, c) if append_one else None
        if sums is not None and lay.border_offsets:
            sums = sums.clone()
        for k, (border, missed_sum) in zip(lay.border_offsets, _borders(
                buf, lay, b, precision, border_chunk, sums is not None)):
            blocks[k, k:].sub_(border.view(c, kk - k, c).transpose(0, 1))
            if sums is not None and missed_sum is not None:
                sums[k].sub_(missed_sum)
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


def _borders(buf: Tensor, lay: _Layout, b: int, precision: MatmulPrecision, chunk: int,
             with_sums: bool) -> list[tuple[Tensor, Tensor | None]]:
    """Per border offset, its missed pixels against their patch blocks, and their sums.

    For offset ``k``: ``(C, (kk − k)·C)``, the blocks from ``k`` on (the ones below the
    diagonal are their transposes), and ``(C,)``, the pixels' sums rounded as the
    products see them (only ``with_sums``); over whole images gathered at most ``chunk``
    patch elements at a time.
    """
    c = buf.shape[1]
    out: list[tuple[Tensor, Tensor | None]] = []
    per_image = sum(p.numel() for p in lay.border_patches) * c
    per_chunk = max(1, chunk // max(1, per_image))
    for first in range(0, b, per_chunk):
        starts = lay.images_at + lay.image_rows * torch.arange(
            first, min(b, first + per_chunk), device=buf.device)
        for k, rows in enumerate(lay.border_patches):
            index = (rows.unsqueeze(0) + starts.view(-1, 1, 1)).reshape(-1)
            patches = buf.index_select(0, index).reshape(-1, rows.shape[1] * c)
            missed = patches[:, :c]  # the pixel itself: its patch at its own offset
            border = matmul(missed.t(), patches, precision)
            sums = round_operand(missed, precision).sum(dim=0) if with_sums else None
            if first == 0:
                out.append((border, sums))
            else:
                out[k][0].add_(border)
                if sums is not None:
                    cast(Tensor, out[k][1]).add_(sums)
    return out


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


def shifted_products_flops(b: int, h: int, w: int, kernel_size: Pair, dilation: Pair,
                           pads: Pads) -> tuple[int, int]:
    """Multiply-adds per ``C²`` of the shifted products and of the patch rows' product.

    Returns:
        ``(shifted, rows)``: the shifted products with their borders, as
        :func:`shifted_covariance` computes them (each offset ``k``'s missed pixels
        against the ``kh·kw − k`` blocks from ``k`` on), and one full GEMM of the
        ``b·Ho·Wo`` patch rows (``(kh·kw)²`` blocks; a symmetric update does about half).
    """
    lay = _layout(h, w, tuple(kernel_size), tuple(dilation), tuple(pads), _HOST)
    ho, wo = conv_output_size(h, w, kernel_size, (1, 1), dilation, pads)
    border = sum(rows.numel() for rows in lay.border_patches)
    kk = kernel_size[0] * kernel_size[1]
    return b * (len(lay.shifts) * lay.image_rows + border), b * ho * wo * kk * kk


def pays(x: Tensor, kernel_size: Pair, stride: Pair, dilation: Pair, pads: Pads,
         path: str) -> bool:
    """Say whether a convolution's expand ``A`` comes from shifted products.

    On the statistics paths of :data:`SHIFTED_PRODUCTS_PATHS` (``path``: ``"cpu"`` or
    ``"gpu"``), for stride 1 and a kernel of more than one offset, where they need at
    most :data:`FLOPS_BELOW` of the multiply-adds of the symmetric update.
    """
    if path not in SHIFTED_PRODUCTS_PATHS or x.dim() != 4:
        return False
    if tuple(stride) != (1, 1) or kernel_size[0] * kernel_size[1] == 1:
        return False
    b, _, h, w = x.shape
    shifted, rows = shifted_products_flops(b, h, w, kernel_size, dilation, pads)
    return shifted <= FLOPS_BELOW * rows / 2
