"""Data layer of the reference training driver: data sets and a sharded, resumable loader.

Data sets (:func:`load_dataset`):

* ``digits`` (default): scikit-learn's bundled 8x8 handwritten digits (1797 images,
  no download). Split 1437 train / 360 test by a permutation seeded with
  ``split_seed`` (not ``seed``, so runs with different training seeds are scored on
  the same test set); standardised with the train split's pixel mean and std.
* ``cifar10``: the CIFAR-10 *binary* release read from ``path``.
* ``imagefolder``: ``root/train/<class>/*.png|jpg`` and ``root/val/<class>/...``,
  decoded lazily with Pillow.
* ``synthetic``: seeded Gaussian inputs labelled by a fixed random linear teacher.

Every data set is a :class:`BatchDataset`: it returns whole batches for a tensor of
indices, and any training augmentation is a pure function of
``(seed, epoch, sample index)``. Hence a batch never depends on the rank, the world
size, the batch size or on whether the run was resumed.

:class:`ShardedLoader` conventions (a 1-rank run with batch ``B*P`` is the reference):

* The order of epoch ``e`` is one permutation seeded by ``(seed, e)``, the same on
  every rank and for every world size.
* Global batch ``s`` is positions ``[s*B*P, (s+1)*B*P)`` of that order; rank ``r``
  takes the ``r``-th contiguous slice of ``B`` samples. The concatenation of the
  ranks' batches in rank order is exactly global batch ``s``.
* The position is kept in global samples. A state saved on ``P`` ranks with batch
  ``B`` resumes on ``Q`` ranks with batch ``B'`` at the same sample whenever the
  saved position is a multiple of ``B'*Q`` — always when ``B'*Q == B*P``, the
  supported way to change the number of ranks; the rest of the run is then
  identical to the uninterrupted one.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
from torch import Tensor

__all__ = [
    "CIFAR10_MEAN",
    "CIFAR10_STD",
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "BatchDataset",
    "DatasetSplits",
    "ImageFolderDataset",
    "RandomCropFlip",
    "RandomResizedCropFlip",
    "ShardedBatchSampler",
    "ShardedLoader",
    "TensorDataset",
    "dataset_names",
    "load_dataset",
    "rescaled_batch_size",
]

CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

CIFAR10_TRAIN_FILES = tuple(f"data_batch_{i}.bin" for i in range(1, 6))
CIFAR10_TEST_FILE = "test_batch.bin"
CIFAR10_CLASSES = (
    "airplane", "automobile", "bird", "cat", "deer",
    "dog", "frog", "horse", "ship", "truck",
)  # fmt: skip
_CIFAR_RECORD = 1 + 3 * 32 * 32
_IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg")

# Stream identifiers mixed into seeds so that independent random streams never coincide.
_STREAM_ORDER = 1
_STREAM_AUGMENT = 2
_STREAM_SYNTHETIC = 3
_STREAM_RESIZED_CROP = 4

#: ImageNet evaluation: resize the shorter side to ``image_size / EVAL_CROP_FRACTION``
#: (256 for 224), then take the centre ``image_size`` square.
EVAL_CROP_FRACTION = 0.875


def _mix_seed(*parts: int) -> int:
    """Mix integer parts into a 63-bit seed (SeedSequence hashing; negative parts allowed)."""
    entropy = [int(p) % (1 << 64) for p in parts]
    return int(np.random.SeedSequence(entropy).generate_state(1, dtype=np.uint64)[0] >> 1)


def _generator(*parts: int) -> torch.Generator:
    return torch.Generator().manual_seed(_mix_seed(*parts))


# ------------------------------------------------------------------ augmentation


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
        g = _generator(self.seed, epoch, _STREAM_AUGMENT)
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
        g = _generator(self.seed, epoch, _STREAM_RESIZED_CROP, index)
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


# ----------------------------------------------------------------------- datasets


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
        image_module = _require_pillow()
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


def _require_pillow() -> Any:
    try:
        from PIL import Image
    except ImportError as exc:
        raise ImportError(
            "the 'imagefolder' data set needs Pillow to decode images; "
            "install it with `pip install pillow` (or use --dataset cifar10/digits/synthetic)"
        ) from exc
    return Image


# ------------------------------------------------------------------ load_dataset


@dataclass(frozen=True)
class DatasetSplits:
    """Train and test sets with what a model needs to know about them.

    ``input_shape`` is the shape of one input as served: ``(features,)`` when flat,
    ``(C, H, W)`` otherwise.
    """

    name: str
    train: torch.utils.data.Dataset[Any]  # a BatchDataset for the built-in data sets
    test: torch.utils.data.Dataset[Any]
    num_classes: int
    input_shape: tuple[int, ...]
    classes: tuple[str, ...] | None = None

    def model_kwargs(self) -> dict[str, int | None]:
        """Keyword arguments for :func:`kfac_hpc.models.build_model`."""
        if len(self.input_shape) == 3:
            c, h, w = self.input_shape
            return {
                "num_classes": self.num_classes,
                "in_channels": c,
                "image_size": h if h == w else max(h, w),
                "input_dim": c * h * w,
            }
        return {
            "num_classes": self.num_classes,
            "in_channels": 1,
            "image_size": None,
            "input_dim": math.prod(self.input_shape),
        }


_DATASETS = ("cifar10", "digits", "imagefolder", "stdlib-text", "synthetic")


def dataset_names() -> list[str]:
    """Names accepted by :func:`load_dataset`."""
    return list(_DATASETS)


def load_dataset(
    name: str = "digits",
    *,
    path: str | os.PathLike[str] | None = None,
    seed: int = 0,
    flat: bool = False,
    augment: bool = False,
    split_seed: int = 0,
    image_size: int | None = None,
    input_shape: Sequence[int] = (3, 32, 32),
    num_classes: int = 10,
    train_size: int = 2048,
    test_size: int = 512,
    num_threads: int = 4,
) -> DatasetSplits:
    """Load data set ``name`` (see :func:`dataset_names`).

    Args:
        name: ``digits`` | ``cifar10`` | ``imagefolder`` | ``synthetic`` | ``stdlib-text``
            (bytes of the standard library's source, 64-byte windows: :mod:`kfac_hpc.train.text`).
        path: directory of ``cifar10`` / ``imagefolder`` (ignored by the others).
        seed: seeds training augmentation and the ``synthetic`` data.
        flat: serve inputs flattened to ``(B, features)`` (for ``mlp``).
        augment: standard training augmentation of the image data sets: ``cifar10``
            and ``synthetic`` images pad-crop (padding ``size // 8``) + horizontal
            flip (``digits``: padding 1); ``imagefolder`` (ImageNet) random resized
            crop + flip. Evaluation always uses the un-augmented images
            (``imagefolder``: resize to ``image_size / 0.875`` + centre crop).
        split_seed: seed of the ``digits`` train/test split.
        image_size: ``imagefolder`` output size (default 224).
        input_shape: ``synthetic`` only: one input's shape.
        num_classes: ``synthetic`` only: the number of classes.
        train_size: ``synthetic`` only: training samples.
        test_size: ``synthetic`` only: test samples.
        num_threads: image decoding threads per rank (``imagefolder``).

    Raises:
        ValueError: unknown name, missing/ill-formed files, bad sizes.
    """
    if name == "digits":
        return _load_digits(seed=seed, split_seed=split_seed, flat=flat, augment=augment)
    if name == "cifar10":
        return _load_cifar10(path, seed=seed, flat=flat, augment=augment)
    if name == "imagefolder":
        return _load_imagefolder(
            path,
            seed=seed,
            flat=flat,
            augment=augment,
            image_size=224 if image_size is None else image_size,
            num_threads=num_threads,
        )
    if name == "synthetic":
        return _load_synthetic(
            seed=seed,
            flat=flat,
            augment=augment,
            input_shape=tuple(input_shape),
            num_classes=num_classes,
            train_size=train_size,
            test_size=test_size,
        )
    if name == "stdlib-text":  # byte-level language modelling (kfac_hpc/train/text.py)
        from kfac_hpc.train.text import load_stdlib_text

        return load_stdlib_text()
    raise ValueError(f"unknown dataset {name!r}; valid names: {', '.join(_DATASETS)}")


DIGITS_TEST_SIZE = 360


def _load_digits(*, seed: int, split_seed: int, flat: bool, augment: bool) -> DatasetSplits:
    try:
        from sklearn.datasets import load_digits
    except ImportError as exc:
        raise ImportError(
            "the 'digits' data set ships with scikit-learn; install it with "
            "`pip install scikit-learn` (or `pip install kfac_hpc[train]`)"
        ) from exc
    bunch = load_digits()
    images = torch.as_tensor(np.asarray(bunch.images), dtype=torch.float32).unsqueeze(1)
    labels = torch.as_tensor(np.asarray(bunch.target), dtype=torch.long)
    order = torch.randperm(len(labels), generator=_generator(split_seed))
    test_idx, train_idx = order[:DIGITS_TEST_SIZE], order[DIGITS_TEST_SIZE:]
    train_x = images[train_idx]
    mean, std = float(train_x.mean()), float(train_x.std())

    def make(idx: Tensor, aug: RandomCropFlip | None) -> TensorDataset:
        x = (images[idx] - mean) / std
        return TensorDataset(x, labels[idx], augment=aug, flat=flat)

    train = make(train_idx, RandomCropFlip(seed=seed, padding=1) if augment else None)
    test = make(test_idx, None)
    return DatasetSplits("digits", train, test, 10, train.sample_shape)


def _cifar_layout(root: Path) -> str:
    return (
        f"expected the CIFAR-10 binary version (cifar-10-binary.tar.gz, extracted) as "
        f"{root}/data_batch_1.bin ... data_batch_5.bin and {root}/test_batch.bin, each "
        f"a sequence of {_CIFAR_RECORD}-byte records (1 label byte, then 3072 pixel "
        f"bytes: 1024 red, 1024 green, 1024 blue, row-major 32x32)"
    )


def _read_cifar_file(file: Path, root: Path) -> tuple[Tensor, Tensor]:
    if not file.is_file():
        raise ValueError(f"CIFAR-10: missing file {file}; {_cifar_layout(root)}")
    raw = np.fromfile(file, dtype=np.uint8)
    if raw.size == 0 or raw.size % _CIFAR_RECORD:
        raise ValueError(
            f"CIFAR-10: {file} has {raw.size} bytes, not a positive multiple of the "
            f"{_CIFAR_RECORD}-byte record (truncated or not the binary version?); "
            f"{_cifar_layout(root)}"
        )
    records = raw.reshape(-1, _CIFAR_RECORD)
    labels = torch.from_numpy(records[:, 0].astype(np.int64))
    if int(labels.max()) > 9:
        raise ValueError(
            f"CIFAR-10: {file} has label {int(labels.max())} > 9 (the CIFAR-100 binary "
            f"format has 2 label bytes and is not supported); {_cifar_layout(root)}"
        )
    images = torch.from_numpy(records[:, 1:].reshape(-1, 3, 32, 32).copy())
    return images, labels


def _load_cifar10(
    path: str | os.PathLike[str] | None, *, seed: int, flat: bool, augment: bool
) -> DatasetSplits:
    if path is None:
        raise ValueError(
            "the 'cifar10' data set needs path=<directory> (--data-path); "
            + _cifar_layout(Path("<directory>"))
        )
    root = Path(path)
    if not (root / CIFAR10_TRAIN_FILES[0]).exists() and (root / "cifar-10-batches-bin").is_dir():
        root = root / "cifar-10-batches-bin"  # the archive's top-level folder
    if not root.is_dir():
        raise ValueError(f"CIFAR-10: {root} is not a directory; {_cifar_layout(root)}")
    parts = [_read_cifar_file(root / f, root) for f in CIFAR10_TRAIN_FILES]
    train_x = torch.cat([p[0] for p in parts])
    train_y = torch.cat([p[1] for p in parts])
    test_x, test_y = _read_cifar_file(root / CIFAR10_TEST_FILE, root)
    norm: dict[str, Any] = {"scale": 1.0 / 255.0, "mean": CIFAR10_MEAN, "std": CIFAR10_STD}
    aug = RandomCropFlip(seed=seed, padding=4) if augment else None
    train = TensorDataset(train_x, train_y, augment=aug, flat=flat, **norm)
    test = TensorDataset(test_x, test_y, flat=flat, **norm)
    return DatasetSplits("cifar10", train, test, 10, train.sample_shape, CIFAR10_CLASSES)


def _list_images(split_dir: Path, class_index: Mapping[str, int]) -> list[tuple[str, int]]:
    samples: list[tuple[str, int]] = []
    for cls in sorted(d.name for d in split_dir.iterdir() if d.is_dir()):
        if cls not in class_index:
            raise ValueError(
                f"imagefolder: class folder {split_dir / cls} has no counterpart in "
                f"{split_dir.parent / 'train'}; val classes must be a subset of train classes"
            )
        files = sorted(
            f for f in (split_dir / cls).iterdir() if f.suffix.lower() in _IMAGE_EXTENSIONS
        )
        samples += [(str(f), class_index[cls]) for f in files]
    return samples


def _load_imagefolder(
    path: str | os.PathLike[str] | None,
    *,
    seed: int,
    flat: bool,
    augment: bool,
    image_size: int,
    num_threads: int,
) -> DatasetSplits:
    layout = "expected root/train/<class>/*.png|jpg|jpeg and root/val/<class>/*.png|jpg|jpeg"
    if path is None:
        raise ValueError(f"the 'imagefolder' data set needs path=<root> (--data-path); {layout}")
    if image_size < 1:
        raise ValueError(f"image_size must be >= 1, got {image_size}")
    _require_pillow()
    root = Path(path)
    for split in ("train", "val"):
        if not (root / split).is_dir():
            raise ValueError(f"imagefolder: missing directory {root / split}; {layout}")
    classes = tuple(sorted(d.name for d in (root / "train").iterdir() if d.is_dir()))
    if not classes:
        raise ValueError(f"imagefolder: no class folders in {root / 'train'}; {layout}")
    class_index = {c: i for i, c in enumerate(classes)}
    train_samples = _list_images(root / "train", class_index)
    val_samples = _list_images(root / "val", class_index)
    for split, samples in (("train", train_samples), ("val", val_samples)):
        if not samples:
            raise ValueError(f"imagefolder: no .png/.jpg/.jpeg files under {root / split}")
    common: dict[str, Any] = {"image_size": image_size, "flat": flat, "num_threads": num_threads}
    aug = RandomResizedCropFlip(seed=seed, size=image_size) if augment else None
    train = ImageFolderDataset(train_samples, augment=aug, **common)
    test = ImageFolderDataset(val_samples, **common)
    shape = (3 * image_size * image_size,) if flat else (3, image_size, image_size)
    return DatasetSplits("imagefolder", train, test, len(classes), shape, classes)


def _load_synthetic(
    *,
    seed: int,
    flat: bool,
    augment: bool,
    input_shape: tuple[int, ...],
    num_classes: int,
    train_size: int,
    test_size: int,
) -> DatasetSplits:
    """Draw inputs ~ N(0, 1), labelled argmax(W f(x) + b) by a fixed random teacher (W, b).

    ``f`` is the identity for flat shapes and, for ``(C, H, W)``, average pooling to at
    most 4x4, rescaled to unit variance (keeps the teacher small for large images and
    the classes roughly balanced; conv nets can still fit it).
    Everything is in memory: ``(train_size + test_size) * prod(input_shape) * 4`` bytes.
    """
    if len(input_shape) not in (1, 3) or any(d < 1 for d in input_shape):
        raise ValueError(
            f"synthetic input_shape must be (features,) or (C, H, W), got {input_shape}"
        )
    if num_classes < 2:
        raise ValueError(f"synthetic num_classes must be >= 2, got {num_classes}")
    if train_size < 1 or test_size < 1:
        raise ValueError(
            f"synthetic train_size/test_size must be >= 1, got {train_size}/{test_size}"
        )
    if augment and len(input_shape) != 3:
        raise ValueError("augment=True needs an image input_shape (C, H, W)")
    g = _generator(seed, _STREAM_SYNTHETIC)

    def features(x: Tensor) -> Tensor:
        if x.dim() == 4:
            h, w = x.shape[2:]
            ph, pw = min(h, 4), min(w, 4)
            # rescale so that pooled N(0, 1) inputs stay ~N(0, 1): balanced classes
            x = torch.nn.functional.adaptive_avg_pool2d(x, (ph, pw)) * math.sqrt(h * w / (ph * pw))
        return x.reshape(x.shape[0], -1)

    n_features = features(torch.zeros(1, *input_shape)).shape[1]
    teacher_w = torch.randn(num_classes, n_features, generator=g) / math.sqrt(n_features)
    teacher_b = 0.1 * torch.randn(num_classes, generator=g)

    def make(n: int) -> tuple[Tensor, Tensor]:
        x = torch.randn(n, *input_shape, generator=g)
        y = torch.cat([(features(c) @ teacher_w.T + teacher_b).argmax(1) for c in x.split(4096)])
        return x, y

    train_x, train_y = make(train_size)
    test_x, test_y = make(test_size)
    pad = max(1, input_shape[-1] // 8)
    aug = RandomCropFlip(seed=seed, padding=pad) if augment else None
    train = TensorDataset(train_x, train_y, augment=aug, flat=flat)
    test = TensorDataset(test_x, test_y, flat=flat)
    return DatasetSplits("synthetic", train, test, num_classes, train.sample_shape)


# -------------------------------------------------------------------- the loader


class ShardedLoader:
    """Deterministic, sharded, resumable batches of ``dataset`` for one rank.

    Each epoch uses one permutation seeded by ``(seed, epoch)`` (the identity when
    ``shuffle=False``), identical on all ranks. Global batch ``s`` is positions
    ``[s*G, (s+1)*G)`` of it, ``G = batch_size * world_size``; this rank yields the
    slice ``[rank*batch_size, (rank+1)*batch_size)`` of each global batch.

    With ``drop_last=False`` the final, short global batch is split as evenly as
    possible in rank order (``torch.tensor_split``): local sizes then differ by at
    most one and may be zero, but every rank yields the same number of batches, so
    collectives stay matched; weight per-rank means by the local size.

    Iteration continues from the current position to the end of the epoch, then moves
    to the start of the next epoch; :meth:`state_dict` inside the loop body therefore
    names the batch after the one just received. A position is kept in global samples
    (see the module docstring for resuming on another world size). One iterator at a
    time; batches are CPU tensors (move them to the device in the training loop).

    Input pipeline: with ``num_workers > 0`` the batches of the rest of the epoch
    (:class:`ShardedBatchSampler`, the same order) are decoded by a
    ``torch.utils.data.DataLoader`` with that many worker processes, each holding up
    to ``prefetch_factor`` batches ahead, in pinned memory when ``pin_memory`` (set it
    when the device is CUDA). Batches are yielded in order and are bitwise the same as
    with ``num_workers=0`` (augmentation depends only on ``(seed, epoch, index)``); the
    position counts yielded batches, not prefetched ones, so :meth:`state_dict` and
    resume are unchanged. Workers start with each ``for`` loop over the loader.
    """

    def __init__(
        self,
        dataset: torch.utils.data.Dataset[Any],
        *,
        batch_size: int,
        rank: int,
        world_size: int,
        seed: int,
        shuffle: bool,
        drop_last: bool = True,
        num_workers: int = 0,
        pin_memory: bool = False,
        prefetch_factor: int = 2,
    ) -> None:
        """Shard ``dataset``; the position is the start of epoch 0.

        Args:
            dataset: A :class:`BatchDataset` or any map-style data set of
                ``(input, target)``.
            batch_size: Samples per rank and batch.
            rank: This rank.
            world_size: The number of ranks.
            seed: The seed of the sample order.
            shuffle: Shuffle every epoch (else the data set's order).
            drop_last: Drop the last, short global batch.
            num_workers: DataLoader worker processes (0: decode here).
            pin_memory: Batches in pinned memory (for CUDA).
            prefetch_factor: Batches each worker decodes ahead.

        Raises:
            ValueError: A bad rank, size, batch or pipeline option.
        """
        if num_workers < 0 or prefetch_factor < 1:
            raise ValueError(f"num_workers must be >= 0 and prefetch_factor >= 1, got "
                             f"{num_workers} and {prefetch_factor}")
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if not 0 <= rank < world_size:
            raise ValueError(
                f"rank must be in [0, {world_size}) for world_size {world_size}, got {rank}"
            )
        if batch_size < 1:
            raise ValueError(f"batch_size (per rank) must be >= 1, got {batch_size}")
        n = len(dataset)  # type: ignore[arg-type]
        if n < 1:
            raise ValueError("the data set is empty")
        global_batch = batch_size * world_size
        if batch_size > n or (drop_last and global_batch > n):
            raise ValueError(
                f"global batch size {global_batch} (batch_size {batch_size} per rank x "
                f"world_size {world_size}) is larger than the data set ({n} samples), "
                "which leaves no full batch; lower the batch size or use fewer ranks"
            )
        self.dataset = dataset
        self.batch_size = batch_size
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.num_workers = num_workers
        self.pin_memory = pin_memory
        self.prefetch_factor = prefetch_factor
        self._n = n
        self._epoch = 0
        self._batch_index = 0
        self._order_cache: tuple[int, int, Tensor] | None = None

    # -- geometry
    @property
    def global_batch_size(self) -> int:
        """Samples per batch over all ranks."""
        return self.batch_size * self.world_size

    def __len__(self) -> int:
        """Batches per epoch (the same on every rank)."""
        g = self.global_batch_size
        return self._n // g if self.drop_last else -(-self._n // g)

    @property
    def epoch(self) -> int:
        """The epoch of the next batch to be yielded."""
        return self._epoch

    @property
    def batch_index(self) -> int:
        """Index, within the current epoch, of the next batch to be yielded."""
        return self._batch_index

    def order(self, epoch: int) -> Tensor:
        """Return the epoch's sample order (positions -> data set indices), same on all ranks."""
        if self._order_cache is not None and self._order_cache[:2] == (epoch, self.seed):
            return self._order_cache[2]
        if self.shuffle:
            order = torch.randperm(self._n, generator=_generator(self.seed, epoch, _STREAM_ORDER))
        else:
            order = torch.arange(self._n)
        self._order_cache = (epoch, self.seed, order)
        return order

    def indices(self, step: int, epoch: int | None = None) -> Tensor:
        """Return the indices of this rank's batch ``step`` of ``epoch`` (default: current)."""
        if not 0 <= step < len(self):
            raise IndexError(f"step {step} out of range for {len(self)} batches per epoch")
        order = self.order(self._epoch if epoch is None else epoch)
        g = self.global_batch_size
        chunk = order[step * g : (step + 1) * g]
        if chunk.numel() == g:
            return chunk[self.rank * self.batch_size : (self.rank + 1) * self.batch_size]
        return torch.tensor_split(chunk, self.world_size)[self.rank]

    # -- iteration
    def _fetch(self, idx: Tensor, epoch: int) -> tuple[Tensor, Tensor]:
        return fetch_batch(self.dataset, idx, epoch)

    def sampler(self, epoch: int | None = None, start: int | None = None) -> ShardedBatchSampler:
        """Return this rank's batches of ``epoch`` from batch ``start`` (default: the position)."""
        return ShardedBatchSampler(self, self._epoch if epoch is None else epoch,
                                   self._batch_index if start is None else start)

    def data_loader(self, epoch: int | None = None, start: int | None = None
                    ) -> torch.utils.data.DataLoader[tuple[Tensor, Tensor]]:
        """Build the ``DataLoader`` (workers, pinning, prefetch) that :meth:`__iter__` reads."""
        epoch = self._epoch if epoch is None else epoch
        workers = self.num_workers
        return torch.utils.data.DataLoader(
            _EpochBatches(self.dataset, epoch), sampler=self.sampler(epoch, start),
            batch_size=None, num_workers=workers, pin_memory=self.pin_memory,
            prefetch_factor=self.prefetch_factor if workers else None,
            persistent_workers=False)

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor]]:
        """Yield this rank's batches from the position to the end of the epoch.

        Yields:
            ``(inputs, targets)`` CPU tensors.
        """
        epoch = self._epoch
        pipeline: Iterator[tuple[Tensor, Tensor]] | None = None
        if self._batch_index < len(self) and (self.num_workers > 0 or self.pin_memory):
            pipeline = iter(self.data_loader(epoch, self._batch_index))
        try:
            while self._batch_index < len(self):
                if pipeline is None:
                    batch = self._fetch(self.indices(self._batch_index, epoch), epoch)
                else:
                    batch = next(pipeline)
                self._batch_index += 1
                yield batch
                if self._epoch != epoch:  # repositioned while iterating
                    return
            self._epoch, self._batch_index = epoch + 1, 0
        finally:
            del pipeline  # stops the workers (an early break included)

    def with_batch_size(self, batch_size: int) -> ShardedLoader:
        """Return the same loader (data, rank, seed, position) with per-rank ``batch_size``."""
        other = ShardedLoader(self.dataset, batch_size=batch_size, rank=self.rank,
                              world_size=self.world_size, seed=self.seed,
                              shuffle=self.shuffle, drop_last=self.drop_last,
                              num_workers=self.num_workers, pin_memory=self.pin_memory,
                              prefetch_factor=self.prefetch_factor)
        other._epoch = self._epoch
        return other

    def set_epoch(self, epoch: int) -> None:
        """Move to the start of ``epoch``; no-op if already in it (keeps a resumed position)."""
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
        if epoch != self._epoch:
            self._epoch, self._batch_index = epoch, 0

    # -- resumption
    def state_dict(self) -> dict[str, int]:
        """Position as plain ints (HDF5-friendly).

        ``epoch``, ``batch_index`` (next batch), ``seed``, plus ``sample_index``
        (global samples consumed in the epoch: authoritative on load),
        ``global_batch_size`` and ``dataset_size`` (checked on load).
        """
        sample_index = min(self._batch_index * self.global_batch_size, self._n)
        return {
            "epoch": self._epoch,
            "batch_index": self._batch_index,
            "seed": self.seed,
            "sample_index": sample_index,
            "global_batch_size": self.global_batch_size,
            "dataset_size": self._n,
        }

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        """Continue exactly after the saved position (the saved ``seed`` is adopted).

        Raises ``ValueError`` if the data set size differs or the saved position is not
        at a global batch boundary of this loader.
        """
        missing = {"epoch", "batch_index", "seed"} - set(state)
        if missing:
            raise ValueError(f"loader state lacks {sorted(missing)}; got keys {sorted(state)}")
        size = int(state.get("dataset_size", self._n))
        if size != self._n:
            raise ValueError(
                f"loader state was saved for a data set of {size} samples, this one has "
                f"{self._n}; resume with the same data set"
            )
        epoch = int(state["epoch"])
        if epoch < 0:
            raise ValueError(f"loader state has negative epoch {epoch}")
        g = self.global_batch_size
        if "sample_index" in state:
            sample = int(state["sample_index"])
        else:
            sample = int(state["batch_index"]) * int(state.get("global_batch_size", g))
        end = len(self) * g if self.drop_last else self._n
        if sample < 0:
            raise ValueError(f"loader state has negative position {sample}")
        if sample >= end:
            batch_index = len(self)
        elif sample % g == 0:
            batch_index = sample // g
        else:
            saved_g = state.get("global_batch_size", "?")
            raise ValueError(
                f"loader state is at global sample {sample} of epoch {epoch} (global batch "
                f"{saved_g}), not a multiple of this loader's global batch {g} "
                f"(batch_size {self.batch_size} x world_size {self.world_size}); keep "
                "batch_size * world_size equal to the saved global batch when resuming"
            )
        self.seed = int(state["seed"])
        self._epoch, self._batch_index = epoch, batch_index


def fetch_batch(dataset: torch.utils.data.Dataset[Any], idx: Tensor,
                epoch: int) -> tuple[Tensor, Tensor]:
    """Return the batch of data set indices ``idx``.

    ``get_batch`` of a :class:`BatchDataset`, else the stacked ``dataset[i]`` (any
    map-style data set of ``(input, target)``).

    Args:
        dataset: The data set.
        idx: Data set indices.
        epoch: The epoch whose augmentation to draw.

    Returns:
        ``(inputs, targets)``.
    """
    if isinstance(dataset, BatchDataset):
        return dataset.get_batch(idx, epoch)
    items = [dataset[int(i)] for i in idx]
    if not items:  # a short last batch split over more ranks than it has samples
        x0, _ = dataset[0]
        return torch.empty((0, *torch.as_tensor(x0).shape)), torch.empty(0, dtype=torch.long)
    xs, ys = zip(*items)
    return torch.stack([torch.as_tensor(x) for x in xs]), torch.as_tensor(ys).long()


class ShardedBatchSampler(torch.utils.data.Sampler[Tensor]):
    """The sample order of a :class:`ShardedLoader` as a ``DataLoader`` sampler.

    It yields this rank's index tensor of each batch of ``epoch`` from batch ``start``
    on (use with ``batch_size=None``; the data set turns an index tensor into a batch).
    """

    def __init__(self, loader: ShardedLoader, epoch: int, start: int = 0) -> None:
        """Follow ``loader``'s order.

        Args:
            loader: The loader.
            epoch: The epoch.
            start: The first batch.
        """
        self.loader, self.epoch, self.start = loader, epoch, start

    def __len__(self) -> int:
        """Return the number of batches left."""
        return max(0, len(self.loader) - self.start)

    def __iter__(self) -> Iterator[Tensor]:
        """Yield this rank's index tensor of each batch.

        Yields:
            Data set indices of one batch.
        """
        for step in range(self.start, len(self.loader)):
            yield self.loader.indices(step, self.epoch)


class _EpochBatches(torch.utils.data.Dataset[tuple[Tensor, Tensor]]):
    """``dataset`` seen by a ``DataLoader`` worker: an index tensor -> its batch."""

    def __init__(self, dataset: torch.utils.data.Dataset[Any], epoch: int) -> None:
        self.dataset, self.epoch = dataset, epoch

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, idx: Tensor) -> tuple[Tensor, Tensor]:
        return fetch_batch(self.dataset, idx, self.epoch)


def rescaled_batch_size(global_batch: int, world_size: int, *, multiple_of: int = 1) -> int:
    """Return the per-rank batch that keeps ``global_batch`` on ``world_size`` ranks.

    For a restart on a different number of ranks.

    Args:
        global_batch: The checkpoint's global batch.
        world_size: The number of ranks now.
        multiple_of: The per-rank batch must be a multiple of this (micro-batches).

    Returns:
        The per-rank batch.

    Raises:
        ValueError: No such batch exists (saying why and which rank counts would work).
    """
    if global_batch % world_size:
        fits = [p for p in range(1, min(global_batch, 4096) + 1) if global_batch % p == 0]
        raise ValueError(
            f"cannot keep the checkpoint's global batch {global_batch} on {world_size} "
            f"ranks: {global_batch} is not a multiple of {world_size}, and the sample order, "
            "learning-rate schedule and step count all depend on the global batch. Run on "
            f"a number of ranks dividing {global_batch} ({', '.join(map(str, fits[:12]))}"
            f"{', ...' if len(fits) > 12 else ''}), or start a new run")
    batch = global_batch // world_size
    if batch % multiple_of:
        raise ValueError(
            f"keeping the checkpoint's global batch {global_batch} on {world_size} ranks "
            f"needs {batch} samples per rank, which --accumulation-steps {multiple_of} does "
            "not divide; change --accumulation-steps or the number of ranks")
    return batch
