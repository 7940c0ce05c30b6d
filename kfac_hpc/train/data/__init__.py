"""Data layer of the reference training driver: data sets and a sharded, resumable loader.

Data sets (:func:`load_dataset`, in :mod:`~kfac_hpc.train.data.sources`): ``digits``
(default; scikit-learn's bundled 8x8 digits, no download), ``cifar10`` (the binary
release read from ``path``), ``imagefolder`` (``root/train/<class>/*.png|jpg`` and
``root/val/<class>/...``, decoded lazily with Pillow), ``synthetic`` (seeded Gaussian
inputs labelled by a fixed random linear teacher) and ``stdlib-text``.

Every data set is a :class:`BatchDataset` (:mod:`~kfac_hpc.train.data.datasets`): it
returns whole batches for a tensor of indices, and any training augmentation
(:mod:`~kfac_hpc.train.data.augment`) is a pure function of ``(seed, epoch, sample
index)`` (the streams' seeds: :mod:`~kfac_hpc.train.data.seeds`). Hence a batch never
depends on the rank, the world size, the batch size or on whether the run was resumed.

:class:`ShardedLoader` (:mod:`~kfac_hpc.train.data.loader`) shards one seeded
permutation per epoch over the ranks so that the ranks' batches, concatenated in rank
order, are the global batch of a 1-rank run with batch ``B*P``; its position is kept in
global samples, so a run resumes exactly on another number of ranks that keeps the
global batch ``B*P``.
"""

from kfac_hpc.train.data.augment import RandomCropFlip, RandomResizedCropFlip
from kfac_hpc.train.data.datasets import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    BatchDataset,
    ImageFolderDataset,
    TensorDataset,
)
from kfac_hpc.train.data.loader import ShardedBatchSampler, ShardedLoader, rescaled_batch_size
from kfac_hpc.train.data.sources import (
    CIFAR10_MEAN,
    CIFAR10_STD,
    DatasetSplits,
    dataset_names,
    load_dataset,
)

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
