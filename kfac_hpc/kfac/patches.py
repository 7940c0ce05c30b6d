"""Convolution statistics without ``F.unfold``: the expand A factor and averaged patches.

Pure tensor functions for ``nn.Conv2d`` (groups=1, zero padding), used by
:class:`kfac_hpc.kfac.layers.Conv2dCurvature`.

**Expand A** (:func:`patch_covariance`): ``A = (1/n) Σ_rows ā āᵀ`` over the
``n = b·Ho·Wo`` output positions, ``ā`` the input patch in the weight's column order
``(c, i, j)`` (channel-major, like ``weight.reshape(out, -1)``), plus a trailing ``1``
when the layer has a bias. The ``F.unfold`` path builds the ``(b, C·kh·kw, T)`` patch
tensor and then either a transposed copy of it or ``b`` partial ``d×d`` products.
Here instead:

* the rows are written **channels-last and offset-major** (``(b, Ho, Wo, kh·kw, C)``):
  every kernel offset ``(i, j)`` is one strided slice of the zero-padded NHWC input
  copied into its ``C`` contiguous columns, so the rows need one write and no
  transposed copy;
* the Gram matrix is a **symmetric rank-k update**: only block rows of the upper
  triangle are multiplied (``rowsᵀ[a:b] · rows[:, a:]``), ``(m+1)/(2m)`` of the flops of
  a full product for ``m`` block rows, then mirrored;
* rows are built and accumulated over **chunks of samples**, so the patch matrix never
  exists for the whole batch (peak extra memory ≈ ``chunk_rows · d`` elements instead
  of ``2·b·T·d``);
* the offset-major result is permuted to the weight's ``(c, i, j)`` order at the end
  (a ``d×d`` gather); the bias row and column (``Σ ā`` and ``n``) come from column
  sums of the rows, so the rows keep an aligned width ``C·kh·kw``.

The result equals the unfold path up to summation order (tested at 1e-12, float64, for
stride, padding incl. ``"same"``, dilation, bias, non-square kernels).

**Reduce** (:func:`averaged_patches`): the mean over output positions of each sample's
patches, ``â_i = (1/T) Σ_t ā_{i,t}`` (without the bias entry). Kernel offset ``(i, j)``
reads input row ``r`` and column ``c`` at some output position or not, independently
per axis, so the sums are ``Σ_{r,c} M_H[r,i] M_W[c,j] x[r,c]`` with 0/1 window
indicators ``M_H`` (``H×kh``) and ``M_W`` (``W×kw``) that encode stride, dilation and
the zero padding (padded positions are simply not read). That is **one GEMM** of the
unpadded input ``(b·C, H·W)`` with ``M_H ⊗ M_W`` (``H·W × kh·kw``, cached per geometry),
or two thin GEMMs (``M_W`` then ``M_H``) when that matrix would be large: one pass over
the input, no padded copy (3.6-10.6x faster than ``kh·kw`` strided-slice sums of the padded
input on ResNet-20's layers, one thread). The patch matrix is never built.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
from torch import Tensor

from kfac_hpc.kfac.linalg import default_gram_blocks, mirror_upper, symmetric_gram_

__all__ = [
    "averaged_patches",
    "conv_output_size",
    "patch_covariance",
    "patch_rows",
    "stacked_patch_rows",
]

Pads = tuple[int, int, int, int]  # (top, bottom, left, right)
Pair = tuple[int, int]


def conv_output_size(h: int, w: int, kernel_size: Pair, stride: Pair, dilation: Pair,
                     pads: Pads) -> Pair:
    """``(Ho, Wo)`` of a convolution with explicit ``(top, bottom, left, right)`` padding."""
    (kh, kw), (sh, sw), (dh, dw) = kernel_size, stride, dilation
    top, bottom, left, right = pads
    ho = (h + top + bottom - dh * (kh - 1) - 1) // sh + 1
    wo = (w + left + right - dw * (kw - 1) - 1) // sw + 1
    return ho, wo


def _input_geometry(x: Tensor, kernel_size: Pair, stride: Pair, dilation: Pair, pads: Pads,
                    what: str) -> tuple[int, int, int, int, int, int]:
    """Return ``(b, C, H, W, Ho, Wo)`` of a ``(b, C, H, W)`` input.

    ``(b, C, H, W, Ho, Wo)`` of a ``(b, C, H, W)`` input (a ValueError naming ``what``
    for any other rank).
    """
    if x.dim() != 4:
        raise ValueError(f"{what} expects (b, C, H, W) input, got {tuple(x.shape)}")
    b, c, h, w = x.shape
    ho, wo = conv_output_size(h, w, kernel_size, stride, dilation, pads)
    return b, c, h, w, ho, wo


def _offset_slices(ho: int, wo: int, kernel_size: Pair, stride: Pair,
                   dilation: Pair) -> list[tuple[slice, slice]]:
    """Return, per kernel offset, the padded input rows and columns it reads.

    Per kernel offset ``(i, j)`` (row-major), the rows and columns of the padded input
    it reads at every output position.
    """
    (kh, kw), (sh, sw), (dh, dw) = kernel_size, stride, dilation
    return [
        (slice(i * dh, i * dh + (ho - 1) * sh + 1, sh),
         slice(j * dw, j * dw + (wo - 1) * sw + 1, sw))
        for i in range(kh) for j in range(kw)
    ]


def patch_covariance(x: Tensor, kernel_size: Pair, stride: Pair, dilation: Pair, pads: Pads,
                     *, append_one: bool = False, chunk_rows: int = 8192,
                     blocks: int | None = None) -> Tensor:
    """Expand ``A`` of a convolution: mean over output positions of ``ā āᵀ``.

    ``x`` is ``(b, C, H, W)``; the result is ``(d, d)`` with ``d = C·kh·kw (+1 with
    append_one)``, columns in the weight's ``(c, i, j)`` order and the bias last; exactly
    symmetric, in ``x``'s dtype. ``chunk_rows`` bounds the rows built at once (whole
    samples, at least one); ``blocks`` the block rows of the symmetric update (default
    by size, see the module docstring).
    """
    b, c, h, w, ho, wo = _input_geometry(x, kernel_size, stride, dilation, pads,
                                         "patch_covariance")
    top, bottom, left, right = pads
    kk = kernel_size[0] * kernel_size[1]
    d = c * kk
    dt = d + int(append_one)
    n = b * ho * wo
    if n == 0 or ho <= 0 or wo <= 0:
        raise ValueError("covariance of zero rows is undefined")
    slices = _offset_slices(ho, wo, kernel_size, stride, dilation)
    per_chunk = max(1, chunk_rows // (ho * wo))
    nb = blocks if blocks is not None else default_gram_blocks(d)
    acc = x.new_zeros(d, d)
    sums = x.new_zeros(d) if append_one else None
    with torch.autocast(device_type=x.device.type, enabled=False):
        for s in range(0, b, per_chunk):
            xc = x[s:s + per_chunk]
            bc = xc.shape[0]
            xp = xc.new_zeros(bc, h + top + bottom, w + left + right, c)
            xp[:, top:top + h, left:left + w] = xc.permute(0, 2, 3, 1)
            rows = xc.new_empty(bc, ho, wo, kk, c)
            for p, (rs, cs) in enumerate(slices):
                rows[:, :, :, p] = xp[:, rs, cs]
            flat = rows.reshape(bc * ho * wo, d)
            symmetric_gram_(acc, flat, nb)
            if sums is not None:
                sums += flat.sum(dim=0)
        full = mirror_upper(acc)
        # offset-major (p, c) -> weight order (c, p)
        perm = torch.arange(d, device=x.device).reshape(kk, c).t().reshape(-1)
        full = full.index_select(0, perm).index_select(1, perm)
        if sums is not None:  # the bias column: Σ ā and the row count, analytically
            sums = sums.index_select(0, perm)
            with_bias = full.new_empty(dt, dt)
            with_bias[:d, :d] = full
            with_bias[:d, d] = sums
            with_bias[d, :d] = sums
            with_bias[d, d] = n
            full = with_bias
    return full.div_(n)


def patch_rows(x: Tensor, kernel_size: Pair, stride: Pair, dilation: Pair, pads: Pads,
               *, column_major: bool = False) -> Tensor:
    """Return every output position's input patch as a row.

    Every output position's input patch as a row, columns in the weight's ``(c, i, j)`` order: the
    rows of ``F.unfold(x).transpose(1, 2)``, the same numbers in the same order.

    Built as one strided view of the (zero-padded) input, ``(b, Ho, Wo, C, kh, kw)``,
    and one copy: two kernels at most, where ``F.unfold`` runs one im2col kernel per
    sample on CUDA and the rows need a transposed copy after it.

    ``column_major``: the same rows as the transposed view of a row-major
    ``(C·kh·kw, b·Ho·Wo)`` copy, whose runs of output positions are runs of the (NCHW)
    input, read and written in order; a Gram product ``rowsᵀ rows`` of them is handed to
    the GEMM as ``x·xᵀ`` of a row-major ``x``.
    """
    b, c, _, _, ho, wo = _input_geometry(x, kernel_size, stride, dilation, pads, "patch_rows")
    (kh, kw), (sh, sw), (dh, dw) = kernel_size, stride, dilation
    top, bottom, left, right = pads
    if any(pads):  # any strides will do (channels-last too): only padding copies
        x = torch.nn.functional.pad(x, (left, right, top, bottom))
    sb, sc, sy, sx = x.stride()
    view = x.as_strided((b, ho, wo, c, kh, kw),
                        (sb, sy * sh, sx * sw, sc, sy * dh, sx * dw), x.storage_offset())
    if column_major:
        return view.permute(3, 4, 5, 0, 1, 2).reshape(c * kh * kw, b * ho * wo).t()
    return view.reshape(b * ho * wo, c * kh * kw)


def stacked_patch_rows(xs: Sequence[Tensor], kernel_size: Pair, stride: Pair, dilation: Pair,
                       pads: Pads, *, column_major: bool = False) -> Tensor:
    """Return :func:`patch_rows` of each of ``L`` same-shaped inputs, stacked: ``(L, n, d)``.

    ``[l]`` holds the same numbers as ``patch_rows(xs[l], ...)`` in the same layout (with
    ``column_major``: ``result.mT`` contiguous, each layer's rows the transposed view of a
    row-major ``(d, n)`` copy). Few kernels whatever ``L``: for an unpadded 1x1 kernel the
    rows are the (strided) inputs themselves, stacked in one copy; otherwise the inputs
    are stacked, zero-padded once, and the patches gathered in one copy.

    Args:
        xs: ``(b, C, H, W)`` inputs of one shape, dtype and device.
        kernel_size: ``(kh, kw)``.
        stride: ``(sh, sw)``.
        dilation: ``(dh, dw)``.
        pads: ``(top, bottom, left, right)`` zero padding.
        column_major: Build each layer's rows column-major.
    """
    b, c, _, _, ho, wo = _input_geometry(xs[0], kernel_size, stride, dilation, pads,
                                         "stacked_patch_rows")
    (kh, kw), (sh, sw), (dh, dw) = kernel_size, stride, dilation
    count, d, n = len(xs), c * kh * kw, b * ho * wo
    if (kh, kw) == (1, 1) and not any(pads):
        picked = [x[:, :, ::sh, ::sw] for x in xs]  # (b, C, Ho, Wo) views
        if column_major:
            return torch.stack([x.transpose(0, 1) for x in picked]).view(count, c, n).mT
        return torch.stack([x.permute(0, 2, 3, 1) for x in picked]).view(count, n, c)
    top, bottom, left, right = pads
    x = torch.stack(list(xs))  # (L, b, C, H, W)
    if any(pads):
        x = torch.nn.functional.pad(x, (left, right, top, bottom))
    sl, sb, sc, sy, sx = x.stride()
    view = x.as_strided((count, b, ho, wo, c, kh, kw),
                        (sl, sb, sy * sh, sx * sw, sc, sy * dh, sx * dw), x.storage_offset())
    if column_major:
        return view.permute(0, 4, 5, 6, 1, 2, 3).reshape(count, d, n).mT
    return view.reshape(count, n, d)


_KRON_MAX = 1 << 18  # entries of M_H ⊗ M_W above which averaged_patches uses two GEMMs


def averaged_patches(x: Tensor, kernel_size: Pair, stride: Pair, dilation: Pair,
                     pads: Pads, *, kron_max: int = _KRON_MAX) -> Tensor:
    """``(b, C·kh·kw)``: each sample's patch averaged over the output positions.

    Columns in the weight's ``(c, i, j)`` order, no bias entry. Equals
    ``F.unfold(...).mean(dim=2)`` (up to summation order) without building the patches
    or padding the input: one GEMM with the window indicator ``M_H ⊗ M_W``, or two thin
    GEMMs when that matrix has more than ``kron_max`` entries (module docstring).
    """
    b, c, h, w, ho, wo = _input_geometry(x, kernel_size, stride, dilation, pads,
                                         "averaged_patches")
    (kh, kw), (sh, sw), (dh, dw) = kernel_size, stride, dilation
    top, _, left, _ = pads
    mh = _window_indicator(h, kh, ho, sh, dh, top, x.dtype, x.device)
    mw = _window_indicator(w, kw, wo, sw, dw, left, x.dtype, x.device)
    with torch.autocast(device_type=x.device.type, enabled=False):
        if h * w * kh * kw <= kron_max:
            sums = x.reshape(b * c, h * w) @ _kron(mh, mw)  # (b·C, kh·kw), offsets (i, j)
        else:
            u = x.reshape(b * c * h, w) @ mw  # (b·C·H, kw): window sums along W
            u = u.reshape(b * c, h, kw).transpose(1, 2).reshape(b * c * kw, h) @ mh
            sums = u.reshape(b * c, kw, kh).transpose(1, 2)  # (b·C, kh, kw)
    return sums.reshape(b, c * kh * kw).div_(ho * wo)


@functools.lru_cache(maxsize=256)
def _window_indicator(n: int, k: int, out: int, stride: int, dilation: int, pad: int,
                      dtype: torch.dtype, device: torch.device) -> Tensor:
    """Return the 0/1 matrix of which input index each kernel offset reads.

    Entry ``[r, i]`` is 1 when kernel offset ``i`` reads input index ``r`` at some output position
    (zero padding of ``pad`` before index 0). Cached: callers must not modify it.
    """
    m = torch.zeros(n, k, dtype=dtype, device="cpu")  # filled on the host, then moved
    for i in range(k):
        first = i * dilation - pad
        for p in range(out):
            r = first + p * stride
            if 0 <= r < n:
                m[r, i] = 1
    return m.to(device)


@functools.lru_cache(maxsize=32)
def _kron(mh: Tensor, mw: Tensor) -> Tensor:
    """``M_H ⊗ M_W`` (``(H·W, kh·kw)``), cached per pair of cached indicators."""
    return torch.kron(mh, mw)
