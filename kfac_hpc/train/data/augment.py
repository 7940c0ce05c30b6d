"""Training augmentation and the evaluation transform, drawn from ``(seed, epoch, index)``.

* :class:`RandomCropFlip`: pad-crop + horizontal flip of a batch (the CIFAR recipe).
* :class:`RandomResizedCropFlip`: random resized crop + flip of one image (ImageNet).
* :func:`resize_center_crop`: the ImageNet evaluation transform.

A draw depends only on the seed, the epoch and the sample index, never on the rank,
the world size, the batch size or a resume.
"""

from __future__ import annotations

import math
from typing import cast

import torch
from torch import Tensor

from kfac_hpc.train.data.seeds import STREAM_AUGMENT, STREAM_RESIZED_CROP, generator

__all__ = ["EVAL_CROP_FRACTION", "RandomCropFlip", "RandomResizedCropFlip", "resize_center_crop"]

#: ImageNet evaluation: resize the shorter side to ``image_size / EVAL_CROP_FRACTION``
#: (256 for 224), then take the centre ``image_size`` square.
EVAL_CROP_FRACTION = 0.875


class RandomCropFlip:
    """Random crop after zero padding, and random horizontal flip, on ``(B, C, H, W)``.

    The crop offset and flip of sample ``i`` in epoch ``e`` are drawn from a generator
    seeded by ``(seed, e)`` for all samples at once, so they depend only on
    ``(seed, e, i)``. Padding is zero in the stored value space (black for raw bytes).
    """

    def __init__(self, *, seed: int, padding: int = 4, flip: bool = True) -> None:
        """Set the draws.

        Args:
            seed: The seed of every draw.
            padding: Zero padding on each side before the crop.
            flip: Also flip horizontally (with probability 1/2).

        Raises:
            ValueError: ``padding`` < 0.
        """
        if padding < 0:
            raise ValueError(f"padding must be >= 0, got {padding}")
        self.seed = seed
        self.padding = padding
        self.flip = flip
        self._cache: tuple[int, int, Tensor] | None = None

    def params(self, epoch: int, n: int) -> Tensor:
        """``(n, 3)`` int64: row offset, column offset, flip flag of each sample."""
        if self._cache is not None and self._cache[:2] == (epoch, n):
            return self._cache[2]
        g = generator(self.seed, epoch, STREAM_AUGMENT)
        offsets = torch.randint(0, 2 * self.padding + 1, (n, 2), generator=g)
        flips = torch.randint(0, 2, (n, 1), generator=g)
        if not self.flip:
            flips.zero_()
        params = torch.cat([offsets, flips], dim=1)
        self._cache = (epoch, n, params)
        return params

    def apply(self, x: Tensor, params: Tensor) -> Tensor:
        """Crop/flip each image of ``x`` by its row of ``params`` (one gather)."""
        b, _, h, w = x.shape
        p = self.padding
        xp = torch.nn.functional.pad(x, (p, p, p, p)) if p else x
        rows = params[:, 0:1] + torch.arange(h)  # (b, h)
        cols = params[:, 1:2] + torch.arange(w)  # (b, w)
        cols = torch.where(params[:, 2:3].bool(), cols.flip(1), cols)
        batch = torch.arange(b)[:, None, None]
        out = xp.permute(0, 2, 3, 1)[batch, rows[:, :, None], cols[:, None, :]]
        return out.permute(0, 3, 1, 2).contiguous()


def _resize_chw(x: Tensor, height: int, width: int) -> Tensor:
    """Resize a ``(C, H, W)`` uint8 image, bilinear and antialiased.

    torchvision's when installed (the ``vision`` extra); else the same filter through
    ``F.interpolate``.
    """
    if tuple(x.shape[1:]) == (height, width):
        return x
    try:
        from torchvision.transforms.v2 import functional as tvf
    except ImportError:
        out = torch.nn.functional.interpolate(
            x[None].float(), size=(height, width), mode="bilinear", align_corners=False,
            antialias=True)[0]
        return out.round_().clamp_(0, 255).to(torch.uint8)
    return cast(Tensor, tvf.resize(x, [height, width], antialias=True))


class RandomResizedCropFlip:
    """ImageNet training augmentation on one ``(C, H, W)`` image.

    A random crop of ``scale`` of the area and aspect ratio in ``ratio`` (log-uniform), resized to
    ``size x size``, then a random horizontal flip; torchvision's
    ``RandomResizedCrop`` + ``RandomHorizontalFlip`` algorithm (10 tries, then a
    clamped centre crop), with the draws of sample ``i`` in epoch ``e`` seeded by
    ``(seed, e, i)``: the same in any worker process, on any rank, after a resume.
    """

    def __init__(self, *, seed: int, size: int, scale: tuple[float, float] = (0.08, 1.0),
                 ratio: tuple[float, float] = (3 / 4, 4 / 3), flip: bool = True) -> None:
        """Set the draws.

        Args:
            seed: The seed of every draw.
            size: The output's side.
            scale: Range of the crop's share of the area.
            ratio: Range of the crop's aspect ratio.
            flip: Also flip horizontally (with probability 1/2).

        Raises:
            ValueError: A bad size, scale or ratio.
        """
        if size < 1:
            raise ValueError(f"size must be >= 1, got {size}")
        if not 0 < scale[0] <= scale[1] <= 1 or not 0 < ratio[0] <= ratio[1]:
            raise ValueError(f"bad scale {scale} or ratio {ratio}")
        self.seed, self.size, self.scale, self.ratio, self.flip = seed, size, scale, ratio, flip

    def params(self, epoch: int, index: int, height: int, width: int
               ) -> tuple[int, int, int, int, bool]:
        """``(top, left, crop height, crop width, flip)`` of sample ``index``."""
        g = generator(self.seed, epoch, STREAM_RESIZED_CROP, index)
        area = height * width
        log_lo, log_hi = math.log(self.ratio[0]), math.log(self.ratio[1])
        draws = torch.rand(10, 4, generator=g, dtype=torch.float64).tolist()
        flip = self.flip and bool(torch.randint(0, 2, (1,), generator=g).item())
        for u_area, u_ratio, u_top, u_left in draws:
            target = area * (self.scale[0] + (self.scale[1] - self.scale[0]) * u_area)
            aspect = math.exp(log_lo + (log_hi - log_lo) * u_ratio)
            w = round(math.sqrt(target * aspect))
            h = round(math.sqrt(target / aspect))
            if 0 < w <= width and 0 < h <= height:
                top = min(int(u_top * (height - h + 1)), height - h)
                left = min(int(u_left * (width - w + 1)), width - w)
                return top, left, h, w, flip
        aspect = width / height  # fallback: centre crop at the nearest allowed ratio
        if aspect < self.ratio[0]:
            w, h = width, round(width / self.ratio[0])
        elif aspect > self.ratio[1]:
            h, w = height, round(height * self.ratio[1])
        else:
            w, h = width, height
        return (height - h) // 2, (width - w) // 2, h, w, flip

    def apply(self, image: Tensor, epoch: int, index: int) -> Tensor:
        """``image`` (C, H, W) uint8 -> augmented (C, size, size) uint8."""
        top, left, h, w, flip = self.params(epoch, index, image.shape[1], image.shape[2])
        out = _resize_chw(image[:, top:top + h, left:left + w], self.size, self.size)
        return out.flip(2) if flip else out


def resize_center_crop(image: Tensor, size: int, resize: int | None = None) -> Tensor:
    """Apply the evaluation transform: resize, then crop the centre.

    The shorter side goes to ``resize`` (default ``size /``
    :data:`EVAL_CROP_FRACTION`), then the centre ``size x size`` is cropped.

    Args:
        image: A ``(C, H, W)`` uint8 image.
        size: The output's side.
        resize: The shorter side before the crop.

    Returns:
        The ``(C, size, size)`` image.
    """
    resize = round(size / EVAL_CROP_FRACTION) if resize is None else max(size, resize)
    _, h, w = image.shape
    s = resize / min(h, w)
    nh, nw = max(size, round(h * s)), max(size, round(w * s))
    image = _resize_chw(image, nh, nw)
    top, left = (nh - size) // 2, (nw - size) // 2
    return image[:, top:top + size, left:left + size].contiguous()

