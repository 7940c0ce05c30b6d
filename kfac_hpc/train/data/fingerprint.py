"""A short digest of a data set's contents, to check that every rank reads the same data.

Each rank loads its own copy of the data (a node-local copy of an image folder is common
on HPC systems), and each shards one permutation of its own sample count. A copy that
lacks a few files gives a rank other steps per epoch (the ranks' collectives then wait on
each other forever) or, with the same steps, other samples at the same positions
(duplicated and dropped samples, silently). The driver compares the digests of all ranks
before training (:func:`kfac_hpc.train.setup.check_same_data`).

What the digest reads, by the kind of data set:

* :class:`~kfac_hpc.train.data.datasets.TensorDataset`: every byte of the inputs and the
  targets (up to :data:`MAX_HASHED_BYTES`; beyond that, evenly spaced samples adding up
  to about that many bytes, the first and last among them);
* :class:`~kfac_hpc.train.data.datasets.ImageFolderDataset`: every sample's class folder,
  file name and label, from the listing the data set already holds (no file is opened or
  stat'ed: 1.28 million stats per rank would load a parallel file system's metadata
  servers; a file present but damaged is not seen);
* a data set with a ``digest`` attribute (:class:`~kfac_hpc.train.text.TokenWindows`):
  that;
* any other map-style data set (plugins): its length and the bytes of the samples at
  :data:`PROBED_SAMPLES` evenly spaced positions.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

import torch
from torch import Tensor

from kfac_hpc.train.data.datasets import ImageFolderDataset, TensorDataset

__all__ = ["MAX_HASHED_BYTES", "PROBED_SAMPLES", "fingerprint"]

#: The most bytes of a :class:`TensorDataset` hashed whole (beyond: evenly spaced samples).
MAX_HASHED_BYTES = 256 << 20
#: Samples read from a data set of another kind.
PROBED_SAMPLES = 8


def _hash_tensor(digest: Any, tensor: Tensor) -> None:
    """Feed ``tensor``'s shape, dtype and bytes to ``digest``."""
    t = tensor.detach().to("cpu").contiguous()
    digest.update(f"{tuple(t.shape)}{t.dtype}".encode())
    if t.numel():
        digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())


def _positions(n: int, count: int) -> list[int]:
    """``count`` evenly spaced positions of ``range(n)``, the first and the last included."""
    if n <= count:
        return list(range(n))
    return sorted({round(i * (n - 1) / (count - 1)) for i in range(count)})


def _tensor_dataset(digest: Any, ds: TensorDataset) -> None:
    inputs, targets = ds.inputs, ds.targets
    total = inputs.numel() * inputs.element_size() + targets.numel() * targets.element_size()
    if total <= MAX_HASHED_BYTES:
        _hash_tensor(digest, inputs)
        _hash_tensor(digest, targets)
        return
    per_sample = max(1, total // max(1, len(ds)))
    rows = torch.tensor(_positions(len(ds), max(2, MAX_HASHED_BYTES // per_sample)))
    digest.update(f"{tuple(inputs.shape)}{inputs.dtype}{tuple(targets.shape)}".encode())
    _hash_tensor(digest, inputs[rows])
    _hash_tensor(digest, targets[rows])


def _image_folder(digest: Any, ds: ImageFolderDataset) -> None:
    for file, label in ds.samples:
        head, name = os.path.split(file)
        digest.update(f"{os.path.basename(head)}/{name}\0{label}\n".encode())


def _probed(digest: Any, ds: Any) -> None:
    for i in _positions(len(ds), PROBED_SAMPLES):
        for part in ds[i]:
            _hash_tensor(digest, torch.as_tensor(part))


def fingerprint(dataset: Any) -> str:
    """A hex digest of ``dataset``'s length and contents (module docstring).

    Args:
        dataset: A map-style data set with ``__len__``.

    Returns:
        16 hex digits, equal for data sets that read the same (as far as the digest reads).
    """
    digest = hashlib.sha256(f"{type(dataset).__name__}\0{len(dataset)}\0".encode())
    if isinstance(dataset, TensorDataset):
        _tensor_dataset(digest, dataset)
    elif isinstance(dataset, ImageFolderDataset):
        _image_folder(digest, dataset)
    elif isinstance(getattr(dataset, "digest", None), str):
        digest.update(dataset.digest.encode())
    else:
        _probed(digest, dataset)
    return digest.hexdigest()[:16]
