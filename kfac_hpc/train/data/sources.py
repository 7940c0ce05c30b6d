"""The built-in data sets, by name: :func:`load_dataset` and the :class:`DatasetSplits` it returns.

* ``digits`` (default): scikit-learn's bundled 8x8 handwritten digits (1797 images,
  no download). Split 1437 train / 360 test by a permutation seeded with
  ``split_seed`` (not ``seed``, so runs with different training seeds are scored on
  the same test set); standardised with the train split's pixel mean and std.
* ``cifar10``: the CIFAR-10 *binary* release read from ``path``.
* ``imagefolder``: ``root/train/<class>/*.png|jpg`` and ``root/val/<class>/...``,
  decoded lazily with Pillow.
* ``synthetic``: seeded Gaussian inputs labelled by a fixed random linear teacher.
* ``stdlib-text``: bytes of the standard library's source (:mod:`kfac_hpc.train.text`).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from kfac_hpc.train.data.augment import RandomCropFlip, RandomResizedCropFlip
from kfac_hpc.train.data.datasets import ImageFolderDataset, TensorDataset, require_pillow
from kfac_hpc.train.data.seeds import STREAM_SYNTHETIC, generator

__all__ = ["CIFAR10_MEAN", "CIFAR10_STD", "DatasetSplits", "dataset_names", "load_dataset"]

CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)

CIFAR10_TRAIN_FILES = tuple(f"data_batch_{i}.bin" for i in range(1, 6))
CIFAR10_TEST_FILE = "test_batch.bin"
CIFAR10_CLASSES = (
    "airplane", "automobile", "bird", "cat", "deer",
    "dog", "frog", "horse", "ship", "truck",
)  # fmt: skip
_CIFAR_RECORD = 1 + 3 * 32 * 32
_IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg")


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
    order = torch.randperm(len(labels), generator=generator(split_seed))
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


def _class_folders(split_dir: Path) -> list[str]:
    """The class folders of ``split_dir``, sorted; hidden ones (``.ipynb_checkpoints``) skipped."""
    return sorted(d.name for d in split_dir.iterdir() if d.is_dir() and not d.name.startswith("."))


def _list_images(split_dir: Path, class_index: Mapping[str, int], *,
                 every_class: bool) -> list[tuple[str, int]]:
    """``(file, label)`` of the images under ``split_dir`` (hidden files skipped).

    ``every_class``: a class folder without images is an error (the training split:
    its label would never be seen).
    """
    samples: list[tuple[str, int]] = []
    for cls in _class_folders(split_dir):
        if cls not in class_index:
            raise ValueError(
                f"imagefolder: class folder {split_dir / cls} has no counterpart in "
                f"{split_dir.parent / 'train'}; val classes must be a subset of train classes"
            )
        files = sorted(
            f for f in (split_dir / cls).iterdir()
            if f.suffix.lower() in _IMAGE_EXTENSIONS and not f.name.startswith(".")
        )
        if every_class and not files:
            raise ValueError(f"imagefolder: class folder {split_dir / cls} has no "
                             ".png/.jpg/.jpeg files; remove it or add its images")
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
    require_pillow()
    root = Path(path)
    for split in ("train", "val"):
        if not (root / split).is_dir():
            raise ValueError(f"imagefolder: missing directory {root / split}; {layout}")
    classes = tuple(_class_folders(root / "train"))
    if not classes:
        raise ValueError(f"imagefolder: no class folders in {root / 'train'}; {layout}")
    class_index = {c: i for i, c in enumerate(classes)}
    train_samples = _list_images(root / "train", class_index, every_class=True)
    val_samples = _list_images(root / "val", class_index, every_class=False)
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
    g = generator(seed, STREAM_SYNTHETIC)

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

