"""Data sets that serve whole batches: :class:`BatchDataset`, in memory or from image files.

A batch is a function of its sample indices and the epoch (whose augmentation it
draws), never of the rank or the batch size.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch
from torch import Tensor

from kfac_hpc.train.data.augment import RandomCropFlip, RandomResizedCropFlip, resize_center_crop

__all__ = [
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "BatchDataset",
    "ImageFolderDataset",
    "TensorDataset",
    "require_pillow",
]

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


class BatchDataset(torch.utils.data.Dataset[tuple[Tensor, Tensor]]):
    """A data set that serves whole batches: ``get_batch(indices, epoch)``.

    ``epoch=None`` means no augmentation (evaluation, inspection). Inputs are float32,
    targets int64. ``__getitem__`` returns one un-augmented sample.
    """

    def __len__(self) -> int:
        """Return the number of samples."""
        raise NotImplementedError

    def get_batch(self, indices: Tensor, epoch: int | None = None) -> tuple[Tensor, Tensor]:
        """Return the samples ``indices``, augmented for ``epoch``.

        Args:
            indices: Sample indices.
            epoch: The epoch whose augmentation to draw (None: none).

        Returns:
            ``(inputs, targets)`` of the batch.
        """
        raise NotImplementedError

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        """Return sample ``index``, un-augmented.

        Args:
            index: The sample.

        Returns:
            ``(input, target)``.
        """
        x, y = self.get_batch(torch.tensor([index]))
        return x[0], y[0]


def _normalize(
    x: Tensor, scale: float, mean: Sequence[float] | None, std: Sequence[float] | None
) -> Tensor:
    x = x.float()
    if scale != 1.0:
        x = x * scale
    if mean is not None and std is not None:
        shape = (1, -1) + (1,) * (x.dim() - 2)
        x = (x - torch.tensor(mean).view(shape)) / torch.tensor(std).view(shape)
    return x


class TensorDataset(BatchDataset):
    """In-memory inputs ``(N, ...)`` (any dtype) and integer targets ``(N,)``.

    A batch is ``normalise(augment(inputs[idx]))`` with
    ``normalise(x) = (x * scale - mean[c]) / std[c]`` per channel (when ``mean``/``std``
    are given), flattened to ``(B, -1)`` if ``flat``. Storing raw ``uint8`` pixels and
    normalising per batch keeps CIFAR-10 at 150 MB instead of 600 MB.
    """

    def __init__(
        self,
        inputs: Tensor,
        targets: Tensor,
        *,
        scale: float = 1.0,
        mean: Sequence[float] | None = None,
        std: Sequence[float] | None = None,
        augment: RandomCropFlip | None = None,
        flat: bool = False,
    ) -> None:
        """Hold the tensors.

        Args:
            inputs: ``(N, ...)`` inputs, any dtype.
            targets: ``(N,)`` integer targets.
            scale: Factor applied first (``1/255`` for bytes).
            mean: Per-channel mean subtracted after scaling.
            std: Per-channel standard deviation divided by.
            augment: Pad-crop and flip of training batches.
            flat: Flatten inputs to ``(B, -1)``.

        Raises:
            ValueError: Inputs and targets differ in length, or ``augment`` without
                ``(N, C, H, W)`` inputs.
        """
        if inputs.shape[0] != targets.shape[0]:
            raise ValueError(f"{inputs.shape[0]} inputs but {targets.shape[0]} targets")
        if augment is not None and inputs.dim() != 4:
            raise ValueError("augmentation needs (N, C, H, W) image inputs")
        self.inputs = inputs
        self.targets = targets.long()
        self.scale = scale
        self.mean = mean
        self.std = std
        self.augment = augment
        self.flat = flat

    def __len__(self) -> int:
        """Return the number of samples."""
        return int(self.inputs.shape[0])

    @property
    def sample_shape(self) -> tuple[int, ...]:
        """One input's shape as served (flattened when ``flat``)."""
        shape = tuple(self.inputs.shape[1:])
        return (math.prod(shape),) if self.flat else shape

    def get_batch(self, indices: Tensor, epoch: int | None = None) -> tuple[Tensor, Tensor]:
        """Return the samples ``indices``, augmented for ``epoch``.

        Args:
            indices: Sample indices.
            epoch: The epoch whose augmentation to draw (None: none).

        Returns:
            ``(inputs, targets)`` of the batch.
        """
        x = self.inputs[indices]
        if self.augment is not None and epoch is not None:
            x = self.augment.apply(x, self.augment.params(epoch, len(self))[indices])
        x = _normalize(x, self.scale, self.mean, self.std)
        if self.flat:
            x = x.reshape(x.shape[0], -1)
        return x, self.targets[indices]


class ImageFolderDataset(BatchDataset):
    """Lazily decoded images: ``samples`` is a list of ``(file, class index)``.

    Each image is decoded to RGB, then transformed to ``image_size x image_size``:

    * training (``augment`` a :class:`RandomResizedCropFlip`, and an epoch given):
      random resized crop + horizontal flip, drawn from ``(seed, epoch, index)``;
    * otherwise (evaluation, or no augmentation): shorter side resized to
      ``image_size / 0.875`` (256 for 224), centre crop (:func:`resize_center_crop`);
    * a :class:`RandomCropFlip` ``augment`` (pad-crop, the CIFAR recipe) is applied
      after the centre crop.

    Normalised with ``mean``/``std``. ``num_threads`` decodes a batch in parallel
    (Pillow releases the GIL while decoding); with a multi-worker
    :class:`ShardedLoader` each worker process decodes whole batches.
    """

    def __init__(
        self,
        samples: Sequence[tuple[str, int]],
        *,
        image_size: int,
        mean: Sequence[float] = IMAGENET_MEAN,
        std: Sequence[float] = IMAGENET_STD,
        augment: RandomCropFlip | RandomResizedCropFlip | None = None,
        flat: bool = False,
        num_threads: int = 4,
    ) -> None:
        """List the images; nothing is decoded yet.

        Args:
            samples: ``(file, class index)`` pairs.
            image_size: The side of the served images.
            mean: Per-channel mean (of values in [0, 1]).
            std: Per-channel standard deviation.
            augment: The training augmentation, if any.
            flat: Flatten inputs to ``(B, -1)``.
            num_threads: Threads decoding a batch.
        """
        self.samples = list(samples)
        self.image_size = image_size
        self.mean = mean
        self.std = std
        self.augment = augment
        self.flat = flat
        self.num_threads = max(1, num_threads)
        self.targets = torch.tensor([label for _, label in self.samples], dtype=torch.long)

    def __len__(self) -> int:
        """Return the number of images."""
        return len(self.samples)

    def decode(self, index: int) -> Tensor:
        """Decode the full image ``index`` as ``(3, H, W)`` uint8."""
        image_module = require_pillow()
        with image_module.open(self.samples[index][0]) as img:
            array = np.asarray(img.convert("RGB"), dtype=np.uint8).copy()
        return torch.from_numpy(array).permute(2, 0, 1)

    def _load(self, index: int, epoch: int | None) -> Tensor:
        image = self.decode(index)
        if isinstance(self.augment, RandomResizedCropFlip) and epoch is not None:
            return self.augment.apply(image, epoch, index)
        return resize_center_crop(image, self.image_size)

    def get_batch(self, indices: Tensor, epoch: int | None = None) -> tuple[Tensor, Tensor]:
        """Return the samples ``indices``, augmented for ``epoch``.

        Args:
            indices: Sample indices.
            epoch: The epoch whose augmentation to draw (None: none).

        Returns:
            ``(inputs, targets)`` of the batch.
        """
        idx = [int(i) for i in indices]
        if self.num_threads > 1 and len(idx) > 1:
            with ThreadPoolExecutor(min(self.num_threads, len(idx))) as pool:
                images = list(pool.map(self._load, idx, [epoch] * len(idx)))
        else:
            images = [self._load(i, epoch) for i in idx]
        size = self.image_size
        x = torch.stack(images) if images else torch.empty(0, 3, size, size, dtype=torch.uint8)
        if isinstance(self.augment, RandomCropFlip) and epoch is not None:
            x = self.augment.apply(x, self.augment.params(epoch, len(self))[indices])
        x = _normalize(x, 1.0 / 255.0, self.mean, self.std)
        if self.flat:
            x = x.reshape(x.shape[0], -1)
        return x, self.targets[indices]


def require_pillow() -> Any:
    """Return Pillow's ``Image`` module, or raise an ImportError saying how to install it."""
    try:
        from PIL import Image
    except ImportError as exc:
        raise ImportError(
            "the 'imagefolder' data set needs Pillow to decode images; "
            "install it with `pip install pillow` (or use --dataset cifar10/digits/synthetic)"
        ) from exc
    return Image

